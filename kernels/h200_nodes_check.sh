#!/usr/bin/env bash
# One device call on one H200 for groups placed through node agents (`--placement remote`):
#   bench: kernels/bench_serve.py against two groups sharing the GPU placed locally
#          (`--devices 0,0`), then the same two groups placed through two node agents on
#          127.0.0.2 and 127.0.0.3 (both offering device 0) over the CurveZMQ transport;
#   kill:  the chaos scenario chaos/gpu1-node-kill.toml (SIGKILL one agent's tree under load).
# Results land in $OUT. On a machine without a GPU, DEVICE=cpu MODEL=<tiny config dir> DTYPE=float32
# runs the same steps as a smoke test.
#   usage: kernels/h200_nodes_check.sh [bench|kill|all]
source "$(dirname "$0")/device_env.sh"
MODEL=${MODEL:-kernels/configs/qwen3-30b-a3b-24-layers}
DEVICE=${DEVICE:-cuda}
serve=(--model "$MODEL" --load-format dummy --device "$DEVICE" --dtype "${DTYPE:-bfloat16}"
  --num-groups 2 --num-kv-blocks "${KV_BLOCKS:-4096}" --max-model-len 2048
  --max-running-requests 32)
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
date -u +%FT%TZ | tee -a "$OUT/gpu.txt"

bench_serve() {  # name, extra serve flags
  local name=$1
  shift
  timeout "${BENCH_TIMEOUT:-300}" python3 kernels/bench_serve.py --concurrency "${CONC:-1,8,32}" \
    --input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-128}" --rounds "${ROUNDS:-3}" \
    --json "$OUT/serve_$name.json" -- "${serve[@]}" "$@" 2>&1 | tail -12 | tee "$OUT/serve_$name.log"
  echo "== $name rc=$?"
}

agents=()
stop_agents() {
  for pid in "${agents[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
  agents=()
}
trap stop_agents EXIT

case "${1:-all}" in
bench | all)
  if [ "$DEVICE" = cuda ]; then local_devices=(--devices 0,0); else local_devices=(); fi
  bench_serve local "${local_devices[@]}"
  keys=$(mktemp -d)/keys
  python3 -m safeserve.cli keys "$keys" >/dev/null
  port=$(python3 -c 'from safeserve.ports import free_port; print(free_port())')
  for n in 2 3; do  # node a on 127.0.0.2, node b on 127.0.0.3, each in its own process tree
    setsid python3 -m safeserve.cli node --frontend "127.0.0.1:$port" --node-id "n$n" \
      --host "127.0.0.$n" --devices 0 --curve-keys-dir "$keys" >"$OUT/node_n$n.log" 2>&1 &
    agents+=($!)
  done
  bench_serve remote --placement remote --curve-keys-dir "$keys" --node-port "$port"
  stop_agents
  python3 - "$OUT/serve_local.json" "$OUT/serve_remote.json" <<'PY'
import json, sys
local, remote = (json.load(open(p)) for p in sys.argv[1:])
def points(r):
    return {p["concurrency"]: p["measured"] for p in r["points"]}
lp, rp = points(local), points(remote)
print("| conc | local TPOT ms | remote TPOT ms | remote/local | local ITL ms | remote ITL ms | remote/local | unfinished |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for c in sorted(lp):
    a, b = lp[c], rp[c]
    print(f"| {c} | {a['tpot_ms_median']:.2f} | {b['tpot_ms_median']:.2f} | "
          f"{b['tpot_ms_median'] / a['tpot_ms_median']:.3f} | {a['itl_ms_median']:.2f} | "
          f"{b['itl_ms_median']:.2f} | {b['itl_ms_median'] / a['itl_ms_median']:.3f} | "
          f"{a['unfinished']}/{b['unfinished']} |")
PY
  ;;&
kill | all)
  scenario=${SCENARIO:-chaos/gpu1-node-kill.toml}
  timeout "${CHAOS_TIMEOUT:-330}" python3 -m safeserve.cli chaos run "$scenario" \
    --json "$OUT/chaos_node_kill.json" --server-log "$OUT/chaos_node_kill_server.log" \
    ${CHAOS_ARGS:+--server-args "$CHAOS_ARGS"} 2>&1 | tail -40 | tee "$OUT/chaos_node_kill.log"
  ;;
esac

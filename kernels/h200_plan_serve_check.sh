#!/usr/bin/env bash
# `safeserve plan`'s start-up sizing against a real `safeserve serve` on one GPU: for each config,
# the plan's predicted KV blocks and dispatch budget (1 GPU, default flags, bf16), then a server
# started with dummy weights, its /admin/groups and /admin/config read, and the server stopped.
#   usage: kernels/h200_plan_serve_check.sh CONFIG_DIR...   (results in $OUT/plan_serve_*.json)
source "$(dirname "$0")/device_env.sh"
for model in "$@"; do
  name=$(basename "$model")
  python3 -m safeserve.cli plan --model "$model" --gpu h200 --gpus-per-node 1 --concurrency 1,64 \
    -o json >"$OUT/plan_$name.json" 2>/dev/null
  python3 -m safeserve.cli serve --model "$model" --load-format dummy --device cuda \
    --dtype bfloat16 --port 8100 --admin-port 8101 >"$OUT/serve_$name.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8100/ready', timeout=1)" \
      >/dev/null 2>&1 && break
    sleep 1
  done
  sleep 2
  python3 - "$OUT/plan_$name.json" "$OUT/plan_serve_$name.json" <<'PY'
import json, sys, urllib.request
plan = json.load(open(sys.argv[1]))
sizing = plan["layouts"][0]["sizing"]
get = lambda p: json.load(urllib.request.urlopen("http://127.0.0.1:8101" + p))
groups = get("/admin/groups")["groups"]
guards = get("/admin/config")["guards"]["0"]
out = {
    "model": plan["model"],
    "kv_blocks_predicted": sizing["kv_blocks"],
    "kv_blocks_served": groups[0]["kv_blocks_total"],
    "dispatch_budget_predicted": sizing["dispatch_budget"],
    "dispatch_budget_served": guards["dispatch_budget_tokens"],
    "prefill_predicted": sizing["prefill"],
    "prefill_served": guards["prefill"],
}
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: v for k, v in out.items() if not k.startswith("prefill")}))
print("prefill equal:", out["prefill_predicted"] == out["prefill_served"])
PY
  kill -TERM $pid
  wait $pid 2>/dev/null
  grep -E "KV cache from device memory" "$OUT/serve_$name.log" | cut -c1-240
done

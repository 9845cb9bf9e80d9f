# Sourced by the kernels/h200_*.sh device scripts: strict mode, unbuffered Python, the results
# folder $OUT, the wheels the GPU image lacks (a .whl folder carried with the tree) installed
# into /tmp/site and put on PYTHONPATH, and `bench_dummy`.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/safeserve-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi

# `safeserve bench` with dummy bf16 weights on CUDA, 512-token prompts and 64 out, on a shape of
# kernels/configs: its JSON and whole log in $OUT (bench_NAME.json, .log), then one status line.
#   usage: bench_dummy NAME CONFIG_DIR CONCURRENCY [more bench flags]
bench_dummy() {
  timeout "${BENCH_TIMEOUT:-200}" python3 -m safeserve.cli bench --model "kernels/configs/$2" \
    --load-format dummy --device cuda --dtype bfloat16 --concurrency "$3" \
    --input-len 512 --output-len 64 --json "$OUT/bench_$1.json" "${@:4}" \
    >"$OUT/bench_$1.log" 2>&1
  echo "== $1 rc=$?"
}

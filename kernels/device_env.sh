# Sourced by the kernels/h200_*.sh device scripts: strict mode, unbuffered Python, the results
# folder $OUT, and the wheels the GPU image lacks (a .whl folder carried with the tree) installed
# into /tmp/site and put on PYTHONPATH.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/safeserve-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi

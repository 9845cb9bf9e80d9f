#!/usr/bin/env bash
# Runs pytest verbosely under a time limit and prints a tally that survives the limit: a run cut
# by `timeout` prints no summary line, so the tally counts the per-test lines of the log.
#   usage: [SHARDS=n] kernels/gpu_pytest.sh SECONDS LOG [pytest arguments ...]
# SHARDS=n splits the collected tests round-robin over n pytest processes run side by side (the
# GPU tests spend most of their time compiling Triton kernels, which is single-threaded per
# process); each writes LOG.<i>, and the tally covers them all.
# Every run draws fresh inputs: SAFESERVE_TEST_SEED (tests/seeds.py) defaults to the clock, and
# the tally line prints it, so a failure reproduces with `SAFESERVE_TEST_SEED=n pytest TEST_ID`.
set -u
export SAFESERVE_TEST_SEED=${SAFESERVE_TEST_SEED:-$(date +%s)}
limit=$1
log=$2
shift 2
shards=${SHARDS:-1}
if [ "$shards" -le 1 ]; then
  timeout "$limit" ${PYTHON:-python3} -m pytest -v -p no:cacheprovider "$@" >"$log" 2>&1
  rc=$?
  logs=("$log")
else
  mapfile -t ids < <(${PYTHON:-python3} -m pytest --collect-only -q -p no:cacheprovider "$@" 2>/dev/null |
    grep '::')
  # keep the options (arguments starting with -), drop the paths: the ids name the tests
  opts=()
  skip_next=0
  for a in "$@"; do
    if [ "$skip_next" = 1 ]; then
      opts+=("$a")
      skip_next=0
    elif [ "$a" = -m ] || [ "$a" = -k ]; then
      opts+=("$a")
      skip_next=1
    elif [[ "$a" == -* ]]; then
      opts+=("$a")
    fi
  done
  logs=()
  pids=()
  for ((i = 0; i < shards; i++)); do
    part=()
    for ((j = i; j < ${#ids[@]}; j += shards)); do part+=("${ids[$j]}"); done
    [ "${#part[@]}" -eq 0 ] && continue
    timeout "$limit" ${PYTHON:-python3} -m pytest -v -p no:cacheprovider "${opts[@]}" "${part[@]}" \
      >"$log.$i" 2>&1 &
    pids+=($!)
    logs+=("$log.$i")
  done
  rc=0
  for p in "${pids[@]}"; do
    wait "$p" || { r=$?; [ "$r" = 124 ] && rc=124; }
  done
  echo "collected ${#ids[@]} tests in $shards shards" >"$log"
fi
passed=$(cat "${logs[@]}" | grep -c ' PASSED')
skipped=$(cat "${logs[@]}" | grep -c ' SKIPPED')
failed=$(cat "${logs[@]}" | grep -c -E ' (FAILED|ERROR)')
note=""
if [ "$rc" = 124 ]; then
  note=" (cut by the ${limit} s limit: the tests after the last one in the log did not run)"
fi
echo "pytest: $passed passed, $skipped skipped, $failed failed$note; seed offset $SAFESERVE_TEST_SEED; log: ${logs[*]}" | tee -a "$log"
cat "${logs[@]}" | grep -E ' (FAILED|ERROR)' | head -20
exit 0

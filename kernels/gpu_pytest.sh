#!/usr/bin/env bash
# Runs pytest verbosely under a time limit and prints a tally that survives the limit: a run cut
# by `timeout` prints no summary line, so the tally counts the per-test lines of the log.
#   usage: kernels/gpu_pytest.sh SECONDS LOG [pytest arguments ...]
set -u
limit=$1
log=$2
shift 2
timeout "$limit" python3 -m pytest -v -p no:cacheprovider "$@" >"$log" 2>&1
rc=$?
passed=$(grep -c ' PASSED' "$log")
skipped=$(grep -c ' SKIPPED' "$log")
failed=$(grep -c -E ' (FAILED|ERROR)' "$log")
note=""
if [ "$rc" = 124 ]; then
  note=" (cut by the ${limit} s limit: the tests after the last one in the log did not run)"
fi
echo "pytest: $passed passed, $skipped skipped, $failed failed$note; log: $log"
grep -E ' (FAILED|ERROR)' "$log" | head -20
exit 0

#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Runs every CTest test of a build dir (default: build) on two cores and ends with one line of
# counts, so a CI log's last line says how many tests passed, failed and were skipped.
#   bash tools/test.sh [build-dir]      NN_TEST_JOBS=<n> runs n tests at once (default 2)
set -uo pipefail
dir=${1:-build}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$SECONDS
ctest --test-dir "$dir" -j"${NN_TEST_JOBS:-2}" --output-on-failure --timeout 900 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}

# ctest's own summary ("100% tests passed, 0 tests failed out of 17") is followed by the time and
# the failed list; repeat it last, with the skip count ctest reports only per test.
total=$(sed -nE 's/.*tests? failed out of ([0-9]+).*/\1/p' "$log" | tail -1)
failed=$(sed -nE 's/.* ([0-9]+) tests? failed out of.*/\1/p' "$log" | tail -1)
skipped=$(grep -c '\*\*\*Skipped' "$log")
if [[ -z $total ]]; then
  echo "tests: no summary from ctest (exit $rc)"
  exit $((rc == 0 ? 1 : rc))
fi
echo "tests: $((total - failed - skipped)) passed, $failed failed, $skipped skipped, of $total ($((SECONDS - start)) s)"
exit "$rc"

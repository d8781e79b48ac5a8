#!/usr/bin/env bash
# Where racecheck's "invalid memcpy_async synchronization" reports on the gathering producers
# fall (docs/TESTING.md, "The sanitizer run": open): one test under racecheck with every report
# kept, summarised by block and thread, by program counter in KERNEL, and by whether the two
# writes' values differ. Every kernel is instrumented: racecheck with `--kernel-name` stopped each
# GPU test tried within a second ("The Sanitizer failed to handle a hardware exception", then
# CUDA_ERROR_ILLEGAL_ADDRESS; an H100, compute-sanitizer of the device image, 2026-12-06), the
# default backward test among them, which passes racecheck unfiltered. Run from the bundle's folder (tests/ beside benches/):
#   ./benches/racecheck_gathering.sh [KERNEL] [TEST] [SECONDS]
# defaults: mok_sm90_backward, gate_up_gathering_its_rows_in_the_producer_is_bitwise_the_engine_path,
# 480. Writes $OUT/racecheck-KERNEL.txt (the summary, also printed); the raw log stays in /tmp.
# Exits non-zero when the test did not pass or the run was cut.
# What it tells apart: the tool not following the ring's `full` → consumers → `empty` order
# reports every gathering thread of a block whose walk re-enters a stage, warp 0 included, some
# with unequal values, and the test passes; a thread whose walk ran out of step would show alone
# (e.g. no warp 0), on stages not one ring apart, or fail the test.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kernel="${1:-mok_sm90_backward}"
test_name="${2:-gate_up_gathering_its_rows_in_the_producer_is_bitwise_the_engine_path}"
seconds="${3:-480}"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
bin="$here/../tests/gpu_unfused"
[ -x "$bin" ] || { [ -f "$bin.gz" ] && gunzip -c "$bin.gz" >"$bin" && chmod +x "$bin"; } || { echo "no $bin" >&2; exit 2; }
log="/tmp/racecheck-$kernel.log"
MOK_SANITIZE=1 timeout -k 60 -s INT "$seconds" compute-sanitizer --tool racecheck --racecheck-report hazard \
    --print-limit 100000 "$bin" --test-threads=1 --exact "$test_name" >"$log" 2>&1
status=$?
summary="$out/racecheck-$kernel.txt"
{
    echo "racecheck of $kernel in $test_name: exit $status (124: cut at $seconds s)"
    grep -aE 'test result|RACECHECK SUMMARY|panicked' "$log" || echo "(no result line)"
    echo "reports per (block, first writing thread):"
    awk '/Potential/ { match($0, /block \([0-9]+,[0-9]+,[0-9]+\)/); b = substr($0, RSTART, RLENGTH); first = 1 }
         /Thread \(/ && first { match($0, /Thread \([0-9]+/); print b, substr($0, RSTART + 8, RLENGTH - 8); first = 0 }' "$log" |
        sort | uniq -c | sort -V -k3,3 -k4,4n
    echo "accesses per program counter (two per report):"
    grep -aoE "$kernel\+0x[0-9a-f]+" "$log" | sort | uniq -c
    echo "the two writes' values (eq: equal, ne: different):"
    grep -a 'Current Value' "$log" | awk '{ gsub(",", "", $5); print ($5 == $9) ? "eq" : "ne" }' | sort | uniq -c
} >"$summary"
cat "$summary"
# Non-zero unless the test ran to its one pass.
grep -aq 'test result: ok. 1 passed' "$log" || { echo "the test did not pass (see $log)" >&2; exit 1; }
exit "$status"

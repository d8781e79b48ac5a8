#!/usr/bin/env bash
# mok GPU bundle runner (written by `cargo xtask gpu-bundle`).
#
# Runs every test binary in tests/ one after another, each with --test-threads=1 (the tests share
# one GPU), logs each to ${OUT:-.}/logs/NAME.log, and ends with the line `N passed, M failed`
# (summed over libtest's `test result:` lines). A binary that crashes, times out or prints no
# result line counts as 1 failed. Exits non-zero when M > 0.
#
# usage: run.sh [--bench] [TEST-ARGS...]
#   --bench, or MOK_BUNDLE_BENCH=1   then run the bench binaries in benches/ too (not counted;
#                                    the scripts there, e.g. run_layer_bench.sh, are run by hand)
#   TEST-ARGS                        passed to every test binary (a name filter, --nocapture, ...)
#   MOK_TEST_TIMEOUT=SECONDS         time limit per test binary (default 300; 0: none)
#   MOK_BENCH_TIMEOUT=SECONDS        time limit per bench binary (default 0: none)
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_dir="${OUT:-.}/logs"
mkdir -p "$log_dir" || exit 2

run_bench=${MOK_BUNDLE_BENCH:-0}
if [ "${1:-}" = "--bench" ]; then
    run_bench=1
    shift
fi

# with_limit SECONDS COMMAND...: runs COMMAND, under `timeout` when SECONDS is not 0.
with_limit() {
    local seconds=$1
    shift
    if [ "$seconds" != 0 ] && command -v timeout >/dev/null 2>&1; then
        timeout --kill-after=10 "$seconds" "$@"
    else
        "$@"
    fi
}

passed=0
failed=0
for bin in "$here"/tests/*; do
    if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then continue; fi
    name=$(basename "$bin")
    log="$log_dir/$name.log"
    echo "=== $name"
    with_limit "${MOK_TEST_TIMEOUT:-300}" "$bin" --test-threads=1 "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    bin_passed=0
    bin_failed=0
    results=0
    while IFS= read -r line; do
        if [[ $line =~ ([0-9]+)\ passed\;\ ([0-9]+)\ failed\; ]]; then
            bin_passed=$((bin_passed + BASH_REMATCH[1]))
            bin_failed=$((bin_failed + BASH_REMATCH[2]))
            results=$((results + 1))
        fi
    done < <(grep -a '^test result: ' "$log")
    if [ "$results" = 0 ]; then
        if [ "$status" = 124 ] || [ "$status" = 137 ]; then
            echo "=== $name: timed out (exit $status), no test result line: counted as 1 failed"
        else
            echo "=== $name: no test result line (exit $status): counted as 1 failed"
        fi
        bin_failed=1
    elif [ "$status" != 0 ] && [ "$bin_failed" = 0 ]; then
        echo "=== $name: exit $status after reporting no failure: counted as 1 failed"
        bin_failed=1
    fi
    passed=$((passed + bin_passed))
    failed=$((failed + bin_failed))
done

bench_failures=0
if [ "$run_bench" = 1 ]; then
    for bin in "$here"/benches/*; do
        if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then continue; fi
        # Only the bench binaries: the scripts beside them (*.py, *.sh) are run by hand.
        case "$bin" in *.py | *.sh) continue ;; esac
        name=$(basename "$bin")
        echo "=== bench $name"
        # `cargo bench` passes --bench to bench executables; do the same.
        with_limit "${MOK_BENCH_TIMEOUT:-0}" "$bin" --bench 2>&1 | tee "$log_dir/bench-$name.log"
        status=${PIPESTATUS[0]}
        if [ "$status" != 0 ]; then
            echo "=== bench $name: failed (exit $status)"
            bench_failures=$((bench_failures + 1))
        fi
    done
fi

echo "$passed passed, $failed failed"
if [ "$failed" != 0 ]; then
    exit 1
fi
if [ "$bench_failures" != 0 ]; then
    exit 2
fi
exit 0

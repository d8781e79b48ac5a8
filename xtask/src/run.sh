#!/usr/bin/env bash
# mok GPU bundle runner (written by `cargo xtask gpu-bundle`).
#
# Runs every test binary in tests/ one after another, each with --test-threads=1 (the tests share
# one GPU), logs each to ${OUT:-.}/logs/NAME.log, and ends with the line `N passed, M failed`
# (summed over libtest's `test result:` lines). A binary that crashes, times out or prints no
# result line counts as 1 failed. Exits non-zero when M > 0.
#
# usage: run.sh [--bench] [TEST-ARGS...]
#        run.sh --sanitize [TEST-ARGS...]
#   --bench, or MOK_BUNDLE_BENCH=1   then run the bench binaries in benches/ too (not counted;
#                                    the scripts there, e.g. run_layer_bench.sh, are run by hand)
#   --sanitize                       run every test binary under each compute-sanitizer tool of
#                                    MOK_SANITIZE_TOOLS (default: memcheck racecheck synccheck
#                                    initcheck) with MOK_SANITIZE=1, which makes the tests use
#                                    their reduced sizes (tests/common: `sanitizing`); ends with one
#                                    line `sanitize: memcheck N errors, racecheck N hazards, ...`
#                                    and the tests' `N passed, M failed`; logs are
#                                    logs/sanitize-TOOL-NAME.log
#   TEST-ARGS                        passed to every test binary (a name filter, --nocapture, ...)
#   MOK_TEST_TIMEOUT=SECONDS         time limit per test binary (default 300, 900 sanitized; 0: none)
#   MOK_BENCH_TIMEOUT=SECONDS        time limit per bench binary (default 0: none)
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_dir="${OUT:-.}/logs"
mkdir -p "$log_dir" || exit 2

run_bench=${MOK_BUNDLE_BENCH:-0}
sanitize=0
if [ "${1:-}" = "--bench" ]; then
    run_bench=1
    shift
elif [ "${1:-}" = "--sanitize" ]; then
    sanitize=1
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

# sanitizer_errors LOG: the reports of a compute-sanitizer log: the sum of its `ERROR SUMMARY`
# lines plus racecheck's warnings (its `RACECHECK SUMMARY: N hazards displayed (E errors, W
# warnings)` counts warnings outside the error summary); empty when the log has no error summary
# (the tool did not finish).
sanitizer_errors() {
    local log=$1 total=0 found=0 line
    while IFS= read -r line; do
        if [[ $line =~ ERROR\ SUMMARY:\ ([0-9]+) ]]; then
            total=$((total + BASH_REMATCH[1]))
            found=1
        elif [[ $line =~ RACECHECK\ SUMMARY:.*\ ([0-9]+)\ warning ]]; then
            total=$((total + BASH_REMATCH[1]))
        fi
    done < <(grep -a -E 'ERROR SUMMARY:|RACECHECK SUMMARY:' "$log")
    if [ "$found" = 1 ]; then echo "$total"; fi
}

# The options of each tool: memcheck also reports device memory still allocated at exit;
# racecheck prints every hazard with both accesses (not only its analysis summary).
tool_options() {
    case "$1" in
        memcheck) echo "--leak-check full" ;;
        racecheck) echo "--racecheck-report all" ;;
        *) echo "" ;;
    esac
}

passed=0
failed=0
sanitizer_summary=""
tools=(plain)
if [ "$sanitize" = 1 ]; then
    if ! command -v compute-sanitizer >/dev/null 2>&1; then
        echo "run.sh --sanitize: compute-sanitizer is not on the PATH"
        exit 2
    fi
    read -r -a tools <<<"${MOK_SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}"
    export MOK_SANITIZE=1
fi
for tool in "${tools[@]}"; do
tool_errors=0
tool_incomplete=0
for bin in "$here"/tests/*; do
    if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then continue; fi
    name=$(basename "$bin")
    if [ "$tool" = plain ]; then
        log="$log_dir/$name.log"
        echo "=== $name"
        with_limit "${MOK_TEST_TIMEOUT:-300}" "$bin" --test-threads=1 "$@" 2>&1 | tee "$log"
        status=${PIPESTATUS[0]}
    else
        log="$log_dir/sanitize-$tool-$name.log"
        echo "=== $name under $tool"
        # shellcheck disable=SC2046
        with_limit "${MOK_TEST_TIMEOUT:-900}" compute-sanitizer --tool "$tool" $(tool_options "$tool") \
            --print-limit 200 "$bin" --test-threads=1 "$@" >"$log" 2>&1
        status=$?
        grep -a -E '^test |^test result: |SUMMARY|^=== ' "$log"
        errors=$(sanitizer_errors "$log")
        if [ -z "$errors" ]; then
            echo "=== $name: $tool printed no summary (exit $status): counted as 1 error"
            errors=1
            tool_incomplete=$((tool_incomplete + 1))
        fi
        tool_errors=$((tool_errors + errors))
    fi
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
if [ "$tool" != plain ]; then
    unit=errors
    if [ "$tool" = racecheck ]; then unit=hazards; fi
    entry="$tool $tool_errors $unit"
    if [ "$tool_incomplete" != 0 ]; then entry="$entry ($tool_incomplete runs unfinished)"; fi
    sanitizer_summary="${sanitizer_summary:+$sanitizer_summary, }$entry"
fi
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

if [ "$sanitize" = 1 ]; then
    echo "sanitize: $sanitizer_summary"
fi
echo "$passed passed, $failed failed"
if [ "$failed" != 0 ]; then
    exit 1
fi
if [ "$sanitize" = 1 ] && [[ ! $sanitizer_summary =~ ^([a-z]+\ 0\ [a-z]+(,\ )?)+$ ]]; then
    exit 3
fi
if [ "$bench_failures" != 0 ]; then
    exit 2
fi
exit 0

#!/usr/bin/env bash
# mok GPU bundle runner (written by `cargo xtask gpu-bundle`).
#
# Runs every test binary in tests/ one after another (a `NAME.gz` there is unpacked first), each with
# --test-threads=1 --nocapture (the tests print what they measured: errors, timings, the soak's
# tally; one test at a time, so their lines do not interleave; the tests share
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
#                                    initcheck), the tools in parallel (one process each, the
#                                    binaries in turn), with MOK_SANITIZE=1, which makes the tests
#                                    use their reduced sizes (tests/common: `sanitizing`). Ends
#                                    with `sanitize: memcheck N errors, racecheck N hazards, ...`
#                                    and the tests' `N passed, M failed`; exits 3 when a tool
#                                    reported anything or did not finish. Logs:
#                                    logs/sanitize-TOOL-NAME.log, and every report's first lines
#                                    and every failed test's panic in logs/sanitize-digest.txt
#   TEST-ARGS                        passed to every test binary (a name filter, --exact, ...)
#   MOK_TEST_TIMEOUT=SECONDS         time limit per test binary (default 300, 600 sanitized; 0: none)
#   MOK_BENCH_TIMEOUT=SECONDS        time limit per bench binary (default 0: none)
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_dir="${OUT:-.}/logs"
mkdir -p "$log_dir" || exit 2

# Large test binaries travel compressed (a device call carries a limited size): unpack each once.
for packed in "$here"/tests/*.gz "$here"/bin/*.gz; do
    [ -f "$packed" ] || continue
    unpacked="${packed%.gz}"
    if [ ! -x "$unpacked" ]; then
        gunzip -c "$packed" >"$unpacked" && chmod +x "$unpacked" || { echo "cannot unpack $packed" >&2; exit 2; }
    fi
done

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

# test_results NAME LOG STATUS: prints `PASSED FAILED` for one binary's run (a run that crashed,
# timed out or printed no result line counts as 1 failed, with a line saying so on stderr).
test_results() {
    local name=$1 log=$2 status=$3 bin_passed=0 bin_failed=0 results=0 line
    while IFS= read -r line; do
        if [[ $line =~ ([0-9]+)\ passed\;\ ([0-9]+)\ failed\; ]]; then
            bin_passed=$((bin_passed + BASH_REMATCH[1]))
            bin_failed=$((bin_failed + BASH_REMATCH[2]))
            results=$((results + 1))
        fi
    done < <(grep -a '^test result: ' "$log")
    if [ "$results" = 0 ]; then
        if [ "$status" = 124 ] || [ "$status" = 137 ]; then
            echo "=== $name: timed out (exit $status), no test result line: counted as 1 failed" >&2
        else
            echo "=== $name: no test result line (exit $status): counted as 1 failed" >&2
        fi
        bin_failed=1
    elif [ "$status" != 0 ] && [ "$bin_failed" = 0 ]; then
        echo "=== $name: exit $status after reporting no failure: counted as 1 failed" >&2
        bin_failed=1
    fi
    echo "$bin_passed $bin_failed"
}

# sanitizer_reports LOG: what a compute-sanitizer log reports: the sum of its `ERROR SUMMARY`
# lines (memcheck, synccheck, initcheck) and of racecheck's `RACECHECK SUMMARY: N hazards
# displayed (E errors, W warnings)` errors and warnings; empty when the log has neither summary
# (the tool did not finish).
sanitizer_reports() {
    local log=$1 total=0 found=0 line
    while IFS= read -r line; do
        if [[ $line =~ ERROR\ SUMMARY:\ ([0-9]+)\ errors?$ ]]; then
            total=$((total + BASH_REMATCH[1]))
            found=1
        elif [[ $line =~ RACECHECK\ SUMMARY:.*\(([0-9]+)\ errors?,\ ([0-9]+)\ warnings? ]]; then
            total=$((total + BASH_REMATCH[1] + BASH_REMATCH[2]))
            found=1
        fi
    done < <(grep -a -E 'ERROR SUMMARY:|RACECHECK SUMMARY:' "$log")
    # A binary that makes no CUDA call (a CPU-only unit-test harness) gives the tool nothing to
    # check: no reports.
    if [ "$found" = 0 ] && grep -a -q 'terminated before first instrumented API call' "$log"; then
        found=1
    fi
    if [ "$found" = 1 ]; then echo "$total"; fi
}

# tool_options TOOL BINARY: memcheck also reports device memory still allocated at exit;
# racecheck prints every hazard with both accesses (not only its analysis summary). A binary
# named burn_* hosts another framework's kernels and memory pools in the same process (burn and
# CubeCL): there the tools check mok's kernels only (`mok*`), memcheck skips the leak check (the
# framework's pools live until exit by design) and initcheck skips host copies (the framework
# copies pitched tensors whole); docs/TESTING.md lists what the tools report without these.
tool_options() {
    local third_party=0
    case "$2" in burn_*) third_party=1 ;; esac
    if [ "$third_party" = 1 ]; then
        printf '%s ' --kernel-name kns=mok
        case "$1" in
            initcheck)
                if compute-sanitizer --help 2>&1 | grep -q -- '--check-api-memory-access'; then
                    echo "--check-api-memory-access no"
                else
                    echo ""
                fi
                ;;
            racecheck) echo "--racecheck-report all" ;;
            *) echo "" ;;
        esac
        return
    fi
    case "$1" in
        memcheck) echo "--leak-check full" ;;
        racecheck) echo "--racecheck-report all" ;;
        *) echo "" ;;
    esac
}

# sanitize_tool TOOL TEST-ARGS...: every test binary under TOOL; writes
# logs/sanitize-TOOL.result as `REPORTS UNFINISHED PASSED FAILED`.
sanitize_tool() {
    local tool=$1 reports=0 unfinished=0 passed=0 failed=0 bin name log status found counts
    shift
    for bin in "$here"/tests/*; do
        if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then continue; fi
        name=$(basename "$bin")
        log="$log_dir/sanitize-$tool-$name.log"
        # shellcheck disable=SC2046
        with_limit "${MOK_TEST_TIMEOUT:-600}" compute-sanitizer --tool "$tool" $(tool_options "$tool" "$name") \
            --print-limit 200 --target-processes all "$bin" --test-threads=1 "$@" >"$log" 2>&1
        status=$?
        found=$(sanitizer_reports "$log")
        if [ -z "$found" ]; then
            echo "=== $name under $tool: no summary (exit $status): counted as 1 report"
            found=1
            unfinished=$((unfinished + 1))
        fi
        # The tool exits 255 for a binary that made no CUDA call; its tests' own result counts.
        if [ "$status" = 255 ] && grep -a -q 'terminated before first instrumented API call' "$log"; then
            status=0
        fi
        read -r bin_passed bin_failed < <(test_results "$name under $tool" "$log" "$status")
        echo "=== $name under $tool: $found reports, $bin_passed passed, $bin_failed failed"
        reports=$((reports + found))
        passed=$((passed + bin_passed))
        failed=$((failed + bin_failed))
    done
    echo "$reports $unfinished $passed $failed" >"$log_dir/sanitize-$tool.result"
}

passed=0
failed=0
if [ "$sanitize" = 1 ]; then
    if ! command -v compute-sanitizer >/dev/null 2>&1; then
        echo "run.sh --sanitize: compute-sanitizer is not on the PATH"
        exit 2
    fi
    read -r -a tools <<<"${MOK_SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}"
    export MOK_SANITIZE=1
    for tool in "${tools[@]}"; do
        rm -f "$log_dir/sanitize-$tool.result"
        sanitize_tool "$tool" "$@" &
    done
    wait
    summary=""
    clean=1
    for tool in "${tools[@]}"; do
        unit=errors
        if [ "$tool" = racecheck ]; then unit=hazards; fi
        if [ -f "$log_dir/sanitize-$tool.result" ]; then
            read -r reports unfinished tool_passed tool_failed <"$log_dir/sanitize-$tool.result"
        else
            reports=1 unfinished=1 tool_passed=0 tool_failed=1
        fi
        entry="$tool $reports $unit"
        if [ "$unfinished" != 0 ]; then entry="$entry ($unfinished runs unfinished)"; fi
        if [ "$reports" != 0 ]; then clean=0; fi
        summary="${summary:+$summary, }$entry"
        passed=$((passed + tool_passed))
        failed=$((failed + tool_failed))
    done
    echo "sanitize: $summary"
    echo "$passed passed, $failed failed"
    # One file with what each tool reported and each failed test's panic (the per-binary logs
    # are many; this one is enough to read the problems).
    digest="$log_dir/sanitize-digest.txt"
    : >"$digest"
    for log in "$log_dir"/sanitize-*-*.log; do
        [ -f "$log" ] || continue
        if grep -a -q -E '^========= (Invalid|Program hit|Uninitialized|Error|Race|Barrier|Warning)|^thread .* panicked' "$log"; then
            echo "##### $(basename "$log")" >>"$digest"
            grep -a -E -A6 '^========= (Invalid|Program hit|Uninitialized|Error|Race|Barrier|Warning)|^thread .* panicked' "$log" |
                head -80 >>"$digest"
        fi
    done
    if [ "$failed" != 0 ]; then exit 1; fi
    if [ "$clean" = 0 ]; then exit 3; fi
    exit 0
fi

for bin in "$here"/tests/*; do
    if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then continue; fi
    name=$(basename "$bin")
    log="$log_dir/$name.log"
    echo "=== $name"
    with_limit "${MOK_TEST_TIMEOUT:-300}" "$bin" --test-threads=1 --nocapture "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    read -r bin_passed bin_failed < <(test_results "$name" "$log" "$status")
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

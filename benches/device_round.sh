#!/usr/bin/env bash
# One device call that checks and times a candidate subset against a base subset and any
# further subsets (all
# `cargo xtask gpu-subset` outputs with `layer`), most important first so that a call cut short
# still returns the essentials: the candidate's tests matching TESTS (default `megakernel`),
# then `layer` base/candidate alternating (compare_layer_subsets.sh, CASES, GEMM, LAYER_ARGS), then the
# candidate's SANITIZE_FILTER tests (default `megakernel_is_bitwise`) under memcheck, racecheck
# and synccheck, bounded by SANITIZE_SECONDS (default 240). Run from the repository root:
#   benches/device_round.sh target/call-new target/next [NAME=target/other ...]
set -uo pipefail
base="$1" candidate="$2"
shift 2
out="${OUT:-./bench-logs}"
mkdir -p "$out/tests" "$out/sanitize" && out="$(cd "$out" && pwd)"  # absolute: run.sh runs elsewhere
echo "tests: $(cd "$candidate" && OUT="$out/tests" ./run.sh "${TESTS:-megakernel}" 2>&1 | tail -1)"
grep -h "^test .* FAILED$\|panicked" "$out"/tests/logs/*.log | head -5
# The tests ran above: none again before the timings.
TESTS= OUT="$out" benches/compare_layer_subsets.sh "base=$base" "candidate=$candidate" "$@"
# run.sh's own per-binary limit stops the tools' processes too; the outer one is a backstop.
sanitize_seconds="${SANITIZE_SECONDS:-240}"
echo "sanitize: $(cd "$candidate" && OUT="$out/sanitize" MOK_SANITIZE_TOOLS="memcheck racecheck synccheck" \
    MOK_TEST_TIMEOUT="$sanitize_seconds" timeout "$((sanitize_seconds + 30))" ./run.sh --sanitize "${SANITIZE_FILTER:-megakernel_is_bitwise}" 2>&1 | tail -2 | tr '\n' ' ')"

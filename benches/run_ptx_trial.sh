#!/usr/bin/env bash
# One device call for a kernel change built here as PTX: the GPU tests matching $TESTS (test-name
# filters separated by spaces, default `megakernel`) on the first PTX given (loaded through MOK_PTX), optionally the same tests under
# compute-sanitizer ($SANITIZE, a test-name filter; empty: none), then the layer benchmark of
# every PTX given with the ceilings and the PyTorch layer measured once in the same call
# (compare_layer_ptx.sh: $CASES, $GEMM, $RANKS). Run from the bundle (or a `cargo xtask gpu-subset`
# folder) root:
#   TESTS=megakernel SANITIZE=backward_megakernel_is CASES=kimi:8192,qwen:8192 GEMM=megakernels \
#       benches/run_ptx_trial.sh new.ptx base.ptx probe.ptx
# Logs go to $OUT (or ./bench-logs); the last lines are the test summary and the bench tables,
# each row prefixed with its PTX's name.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 CANDIDATE.ptx [OTHER.ptx...]" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
candidate="$(realpath "$1")"
tests_summary="tests: not run"
if [ -n "${TESTS-megakernel}" ]; then
    # shellcheck disable=SC2086 # the filters are words, OR'd by libtest
    tests_summary="tests ($(basename "$candidate")): $(MOK_PTX="$candidate" "$here/../run.sh" ${TESTS:-megakernel} 2>&1 | tail -1)"
fi
sanitize_summary="sanitize: not run"
if [ -n "${SANITIZE:-}" ]; then
    sanitize_summary="$(MOK_PTX="$candidate" "$here/../run.sh" --sanitize "$SANITIZE" 2>&1 | tail -2 | tr '\n' ' ')"
fi
ptxs=()
for ptx in "$@"; do ptxs+=("$(realpath "$ptx")"); done
(cd "$here" && ./compare_layer_ptx.sh "${ptxs[@]}") > "$out/compare.log" 2>&1
echo "$tests_summary"
echo "$sanitize_summary"
grep -v '^$' "$out/compare.log" | tail -n 40

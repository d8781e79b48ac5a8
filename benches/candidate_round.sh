#!/usr/bin/env bash
# One device call for a candidate build against a base build (two `cargo xtask gpu-subset
# --benches layer` outputs, e.g. main's and a branch's from build_branch_subset.sh): the
# candidate's tests matching TESTS (default megakernel); then `compare_layer_subsets.sh` over
# both (megakernels, each case of CASES, default kimi:8192,qwen:32768, in both orders; the
# backward alone is the pass column of its `(backward)` rows) on one GPU, at `ep1` (one rank
# through the ranks kernels) and at P = 8 (rings 1.25× an even split); then memcheck, racecheck
# and synccheck over SANITIZE_FILTER (default megakernel_is_bitwise) on the candidate, in what
# is left of TOTAL seconds (default 500; a setting starts only while SAN_MIN seconds, default
# 110, stay left for them). Run from the repository root with both subsets carried; the logs
# come back as $OUT/r.tgz:
#   OUT=$OUT benches/candidate_round.sh target/base target/candidate
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 BASE_SUBSET CANDIDATE_SUBSET" >&2; exit 2; }
base="$(realpath "$1")" cand="$(realpath "$2")"
out="${OUT:-./bench-logs}"; mkdir -p "$out" && out="$(cd "$out" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s); elapsed() { echo $(( $(date +%s) - start )); }
total="${TOTAL:-500}" san_min="${SAN_MIN:-110}"
here="$(dirname "$0")"
echo "candidate tests: $(cd "$cand" && OUT="$out/tests" ./run.sh "${TESTS:-megakernel}" 2>&1 | tail -1)"
for setting in "one:" "ep1:--ranks 1 --ranks-path" "p8:--ranks 8 --ring-factor 1.25"; do
    [ $(( total - san_min - $(elapsed) )) -ge 10 ] || { echo "skip ${setting%%:*}"; continue; }
    echo "== ${setting%%:*} ($(elapsed) s)"
    OUT="$out/${setting%%:*}" CASES="${CASES:-kimi:8192,qwen:32768}" GEMM=megakernels LAYER_ARGS="${setting#*:}" \
        "$here/compare_layer_subsets.sh" base="$base" candidate="$cand"
done
left=$(( total - $(elapsed) ))
echo "sanitizers get $left s"
(cd "$cand" && OUT="$out/sanitize" MOK_SANITIZE_TOOLS="memcheck racecheck synccheck" \
    MOK_TEST_TIMEOUT=$(( left - 15 )) timeout "$left" ./run.sh --sanitize "${SANITIZE_FILTER:-megakernel_is_bitwise}" 2>&1 | tail -2 | tr '\n' ' ')
echo
(cd "$out" && tar czf r.tgz tests one ep1 p8 sanitize 2>/dev/null && rm -rf tests one ep1 p8 sanitize)
echo "done $(elapsed) s"

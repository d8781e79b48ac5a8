#!/usr/bin/env bash
# One device call for a candidate build against a base build (two `cargo xtask gpu-subset
# --benches layer` outputs, e.g. main's and a branch's from build_branch_subset.sh): the
# candidate's tests matching TESTS (default megakernel), then the layer's megakernels at each
# case of CASES (default kimi:8192,qwen:32768) on one GPU, at `ep1` (one rank through the ranks
# kernels) and at P = 8 (rings 1.25× an even split), base and candidate alternating in both
# orders, then memcheck, racecheck and synccheck over SANITIZE_FILTER (default
# megakernel_is_bitwise) on the candidate in what is left of TOTAL seconds (default 500; the
# timings stop SAN_MIN seconds, default 110, before it). Prints one line per run (the backward,
# its parts, the forward and the step, ms) and keeps the logs in $OUT/r.tgz. Run from the
# repository root with both subsets carried:
#   OUT=$OUT benches/candidate_round.sh target/base target/candidate
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 BASE_SUBSET CANDIDATE_SUBSET" >&2; exit 2; }
base="$(realpath "$1")" cand="$(realpath "$2")"
out="${OUT:-./bench-logs}"; mkdir -p "$out" && out="$(cd "$out" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s); elapsed() { echo $(( $(date +%s) - start )); }
total="${TOTAL:-500}" san_min="${SAN_MIN:-110}"
echo "candidate tests: $(cd "$cand" && OUT="$out/tests" MOK_TEST_TIMEOUT=120 ./run.sh "${TESTS:-megakernel}" 2>&1 | tail -1)"
grep -h "^test .* FAILED$\|panicked" "$out"/tests/logs/*.log 2>/dev/null | head -5
mkdir -p "$out/p"
run() { # NAME SUBSET CASE FLAGS...
    local name=$1 dir=$2 case_=$3; shift 3
    [ $(( total - san_min - $(elapsed) )) -ge 8 ] || { echo "skip $name"; return; }
    "$dir/benches/layer" --cases "$case_" --gemm megakernels "$@" > "$out/p/$name.log" 2>&1 || echo "$name: FAILED"
    echo "$name ($(elapsed) s): $(grep -h 'ms, without' "$out/p/$name.log" | sed 's/.*backward \([0-9.]*\) ms, without its weight-gradient tiles \([0-9.]*\) ms.*alone \([0-9.]*\) ms.*/backward \1, without weight gradients \2, weight gradients alone \3,/') $(grep -h '^RESULT' "$out/p/$name.log" | awk '{print $5, $6, $7, $8}')"
}
IFS=',' read -r -a cases <<< "${CASES:-kimi:8192,qwen:32768}"
for round in 1 2; do
    for c in "${cases[@]}"; do
        for setting in one ep1 p8; do
            case $setting in
                one) flags=() ;;
                ep1) flags=(--ranks 1 --ranks-path) ;;
                p8) flags=(--ranks 8 --ring-factor 1.25) ;;
            esac
            # Base first in round 1, the candidate first in round 2.
            if [ "$round" = 1 ]; then order=(base cand); else order=(cand base); fi
            for who in "${order[@]}"; do
                if [ "$who" = base ]; then dir=$base; else dir=$cand; fi
                run "$c-$setting-$who-$round" "$dir" "$c" "${flags[@]}"
            done
        done
    done
done
left=$(( total - $(elapsed) ))
echo "sanitizers get $left s"
(cd "$cand" && OUT="$out/sanitize" MOK_SANITIZE_TOOLS="memcheck racecheck synccheck" \
    MOK_TEST_TIMEOUT=$(( left - 15 )) timeout "$left" ./run.sh --sanitize "${SANITIZE_FILTER:-megakernel_is_bitwise}" 2>&1 | tail -2 | tr '\n' ' ')
echo
(cd "$out" && tar czf r.tgz tests p sanitize 2>/dev/null && rm -rf tests p sanitize)
echo "done $(elapsed) s"

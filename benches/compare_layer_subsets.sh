#!/usr/bin/env bash
# One device call, several bundle subsets of the layer (each `cargo xtask gpu-subset --benches
# layer` output, e.g. the tree's and a probe's from build_patched_subset.sh): with TESTS set,
# each subset's `run.sh $TESTS` first (a name filter; its last line, logs under $OUT/NAME);
# then each subset's `layer` in order and in reverse order, so every build sits at the same
# mean position in the call, printing the rows of the GEMM backends asked for, each prefixed
# with its name; LAYER_ARGS adds flags to every `layer` run (e.g. "--ranks 8 --ring-factor
# 1.25"). Run from the repository root with the subsets carried:
#   TESTS=megakernel CASES=kimi:8192,qwen:8192 GEMM=megakernels \
#       benches/compare_layer_subsets.sh base=target/call-new probe=target/consumers-gather-probe
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 NAME=SUBSET_DIR..." >&2; exit 2; }
out="${OUT:-./bench-logs}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"  # absolute: run.sh runs in each subset
cases="${CASES:-kimi:8192,qwen:8192}"
gemm="${GEMM:-megakernels}"
if [ -n "${TESTS:-}" ]; then
    for spec in "$@"; do
        name="${spec%%=*}" dir="${spec#*=}"
        mkdir -p "$out/$name"
        echo "$name tests: $(cd "$dir" && OUT="$out/$name" ./run.sh "$TESTS" 2>&1 | tail -1)"
    done
fi
layer() {  # NAME=DIR RUN
    local name="${1%%=*}" dir="${1#*=}"
    # shellcheck disable=SC2086 # the extra flags split into words
    "$dir/benches/layer" --cases "$cases" --gemm "$gemm" ${LAYER_ARGS:-} > "$out/layer-$name-$2.log" 2>&1 \
        || echo "$name run $2: FAILED (layer-$name-$2.log)"
    grep -E "^\| [a-z]+ \| [0-9]+ \| " "$out/layer-$name-$2.log" | sed "s/^/$name $2 /"
}
for spec in "$@"; do layer "$spec" 1; done
for ((i = $#; i >= 1; i--)); do layer "${!i}" 2; done

#!/usr/bin/env bash
# One device call, several builds of the GEMM benchmark binary (builds whose host code differs,
# e.g. an experiment branch's `gemm`, which MOK_PTX alone cannot compare): torch, each binary in
# order, each binary in reverse order, torch — so every build and torch sit at the same mean
# position in the call — then one table per build from its two runs and both torch runs.
#   ./compare_bins.sh main=./gemm branch=../branch/gemm
# Run from the bundle's benches/ folder; CASES as in run_gemm_bench.sh; logs go to $OUT.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 NAME=GEMM_BINARY..." >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
cases="${CASES:-kimi:8192,glm:8192,qwen:8192,deepseek:8192,kimi:32768,qwen:32768}"
[ -f "$out/ceilings.log" ] || python3 "$here/ceilings.py" > "$out/ceilings.log" 2>&1
read -r _ _ matmul _ copy < <(grep CEILING "$out/ceilings.log")
torch() {
    PYTHONUNBUFFERED=1 python3 "$here/torch_gemm.py" --cases "$cases" --out "$out/torch_gemm-$1.txt" \
        > "$out/torch_gemm-$1.log" 2>&1
}
mok() {  # NAME=BIN RUN
    "${1#*=}" --cases "$cases" --baseline "$out/torch_gemm-1.txt" --matmul-tflops "$matmul" \
        --copy-tbps "$copy" > "$out/gemm-${1%%=*}-$2.log" 2>&1 || echo "${1%%=*} run $2: FAILED (gemm-${1%%=*}-$2.log)"
}
torch 1
for spec in "$@"; do mok "$spec" 1; done
for ((i = $#; i >= 1; i--)); do mok "${!i}" 2; done
torch 2
for spec in "$@"; do
    name="${spec%%=*}"
    echo "== $name"
    python3 "$here/ratio_table.py" --torch "$out/torch_gemm-1.txt" "$out/torch_gemm-2.txt" \
        --mok "$out/gemm-$name-1.log" "$out/gemm-$name-2.log" --matmul-tflops "$matmul" --copy-tbps "$copy" \
        | tee "$out/table-$name.txt" | grep -v '^|---' | awk -F'|' -v n="$name" 'NR > 1 && NF > 3 {printf "%s %s %s %s\n", n, $2, $4, $7} !/^\|/'
done
